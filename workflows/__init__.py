"""DAGs, the runner (caching, resume) and the `moeflow` command line."""
