"""Running on machines: hostfiles, the hang watchdog, the stop file."""
