"""Environments for multi-turn rollouts: what answers the policy between its turns (tools, a
simulated user). The protocol is in `base.py`; built-in tools in their own modules."""
