"""Running on machines: hostfiles and the hang watchdog."""
