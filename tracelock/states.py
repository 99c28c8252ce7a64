"""Position states of the decoding canvas, one uint8 per position.

Only ``ACTIVE -> LOCKED | EOT`` ever moves. ``PROMPT`` covers the prompt and its left padding
(immutable), ``ACTIVE`` a masked, revisable position, ``LOCKED`` a committed token, and ``EOT`` a
committed end token (or, with stop-at-EOT, a position after one, filled with the pad token).
"""

PROMPT = 0
ACTIVE = 1
LOCKED = 2
EOT = 3

NAMES = {PROMPT: "prompt", ACTIVE: "active", LOCKED: "locked", EOT: "eot"}
