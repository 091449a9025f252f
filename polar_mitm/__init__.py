"""polar-mitm: token-exact RL training data from unmodified coding-agent harnesses."""

import os

__version__ = "0.1.0"

# polar-mitm uses transformers for tokenizers only, never models: its import-time advice that
# PyTorch is missing ("Models won't be available") is noise on every proxy start and CLI run.
# Only the default: a user who sets the variable keeps their choice.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
