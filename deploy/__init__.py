"""Deployment of specmesh: k8s/ (kustomize base, components, overlays), docker/ (images), ray/
(`python -m deploy.ray.launch`). Only ray/ holds Python; it is run from a checkout, not installed."""
