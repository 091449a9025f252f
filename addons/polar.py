"""polar-mitm as a mitmproxy script:

    mitmdump -s addons/polar.py --set polar_upstream=http://127.0.0.1:8000

Works from a checkout (the package next to this folder is importable) and from an install.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polar_mitm.addons.polar import polar_addons  # noqa: E402

addons = [*polar_addons()]
