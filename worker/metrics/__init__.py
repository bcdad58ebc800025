"""What each served step leaves on /metrics and in the step trace."""
