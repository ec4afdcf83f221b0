"""``python -m gossip_pfl`` (what ``torchrun ... -m gossip_pfl run CONFIG`` starts)."""

from gossip_pfl.cli import entry

raise SystemExit(entry())
