"""FlyDSL kernel bodies. Importing anything here imports flydsl: only `build.py` does, lazily."""
