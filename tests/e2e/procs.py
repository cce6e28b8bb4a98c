"""Re-export: the e2e tests start services with specmesh.launch."""

from specmesh.launch import Proc, start

__all__ = ["Proc", "start"]
