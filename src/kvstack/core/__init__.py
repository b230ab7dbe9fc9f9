"""The vocabulary every layer shares: requests, options, registries, errors, units, model
configs.
"""
