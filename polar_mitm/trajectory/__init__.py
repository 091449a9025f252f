"""Trajectories: calls merged into chains (prefix merge, break reasons, exact-prefix chains),
the rollouts a proxy is capturing, and trace rows read back as calls."""
