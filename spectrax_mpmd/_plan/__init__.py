"""The plan passes: a traced stage graph to a runnable `Plan`.

layout -> stage programs -> emit each action in issue order -> reduce gradients
-> the epilogue on the gradients (an optimizer update) -> localize (multi-process) -> seal.
`build_train_plan` and `build_forward_plan` compose them.
"""

from .epilogue import Epilogue, Role, RoleKind
from .forward import build_forward_plan
from .layout import PlanArgs
from .train import build_train_plan

__all__ = ["build_forward_plan", "build_train_plan", "Epilogue", "PlanArgs", "Role", "RoleKind"]
