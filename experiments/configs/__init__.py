"""Config files for real models (``--config experiments/configs/NAME.yaml``) and the reward
functions they name."""
