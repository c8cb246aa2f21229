"""Feature-level drafters: EAGLE, EAGLE-3 and MTP."""
