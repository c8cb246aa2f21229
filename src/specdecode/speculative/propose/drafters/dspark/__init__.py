"""DSpark: DFlash backbone, Markov head, calibrated confidences."""
