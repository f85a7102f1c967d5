"""What the CLI's commands do: train, info, verify, replay, export, plot, gather."""
