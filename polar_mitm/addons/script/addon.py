"""polar-mitm as a mitmdump script, from an install (no checkout needed):

    mitmdump -s "$(polar-mitm addon)" --set polar_upstream=http://127.0.0.1:8000

`polar-mitm addon` prints this file's path; `polar-mitm proxy --upstream URL` runs mitmdump with
it. mitmdump loads the file by path, so the import is absolute: the package is found where it is
installed (the venv mitmdump runs in), never through the current directory.
"""

from polar_mitm.addons.polar import polar_addons

addons = [*polar_addons()]
