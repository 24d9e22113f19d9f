"""Token-faithful reconstruction of training sequences from Polar episode logs."""
from .logfile import EpisodeLog, EpisodeWriter, LogError, read_episode, read_log, validate_episode_id

__all__ = ["EpisodeLog", "EpisodeWriter", "LogError", "read_episode", "read_log", "validate_episode_id"]
