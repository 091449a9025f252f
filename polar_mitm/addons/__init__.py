"""polar-mitm's mitmproxy addons, one per file, each with its options and hooks;
`polar.py` composes them (`polar_addons()`, used by the `addons/polar.py` script). The work is
in the packages they call."""
