"""Step 3 of the workflow: expert-load profile, EPLB placement, operator choices."""
