"""specmesh on a Ray cluster: see launch.py (`python -m deploy.ray.launch --help`)."""
