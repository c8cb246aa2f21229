"""DFlash block-diffusion drafter."""
