"""What the CLI's commands do: one module per command group, its dependencies imported at
the top. workflows/commands/ declares what each command takes (typer signatures, light, all
loaded for `moeflow --help`) and imports its action module when the command runs.
"""
