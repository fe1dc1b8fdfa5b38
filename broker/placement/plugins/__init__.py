"""The placement plugins, one small class per job. The registry lists which run."""
