"""The folder of the mitmdump script an install loads (`mitmdump -s "$(polar-mitm addon)"`).

A folder of its own because mitmproxy puts a script's folder first on `sys.path` while it loads
it: beside the other addon modules (`store.py`, `control.py`, ...) their names would shadow
top-level packages for that moment. Nothing here but `addon.py`.
"""
