"""Model artifacts on disk: target directories, EAGLE-3 draft checkpoints, fingerprints and the compatibility guard."""
