"""Medusa heads on the target's last hidden state."""
