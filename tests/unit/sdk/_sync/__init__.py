# DO NOT EDIT — generated from _async by scripts/unasync.py
