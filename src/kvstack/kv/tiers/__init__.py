"""KV tiers below the device pool (host RAM, disk, Redis); see ``connector.py``."""
