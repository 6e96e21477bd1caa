"""What every call of a group shares: its number, the explanation of a wait
that failed, and the checks of a peer rank."""
