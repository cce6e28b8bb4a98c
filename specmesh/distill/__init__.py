"""Distil a drafter for a target from the target's own outputs (`specmesh train-drafter`)."""
