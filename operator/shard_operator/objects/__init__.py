"""The desired Kubernetes objects of a spec and a Plan, as pure builders: every group's pods,
Services, ConfigMaps and Secret (`manifests.py`), what each pod carries beside the worker's
environment (`podtemplate.py`), the resources ranks ask for (`resources.py`), and the operator's
own RBAC (`permissions.py`).

May import: api, planning (tests/contract/test_boundaries.py)."""
