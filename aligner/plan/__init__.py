"""aligner plan: whether a run fits its GPUs and how long a step takes, before it is submitted."""
