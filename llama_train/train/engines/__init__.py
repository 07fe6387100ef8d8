"""The engines both trainers hand to the library: the Engine protocol (engine.py) and its implementations."""
