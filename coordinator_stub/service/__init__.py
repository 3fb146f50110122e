"""The coordinator's request logic, free of HTTP: the `Coordinator` (`coordinator`), the
instance registry (`instances`), the readers' fair matcher pool (`matchpool`) and the
blend score (`score`). docs/DESIGN.md, "Coordinator layout".
"""
