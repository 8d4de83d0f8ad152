"""CANN status codes and the exception that carries them.

Status values are those of CANN's ``aclnn_return_code`` table. The torch layer raises
:class:`AclnnError`; the ``attngrad.aclnn`` layer turns it back into the status it carries.
"""

ACLNN_SUCCESS = 0
ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002
ACLNN_ERR_RUNTIME_ERROR = 361001
ACLNN_ERR_INNER = 561000
ACLNN_ERR_INNER_INFERSHAPE_ERROR = 561001
ACLNN_ERR_INNER_TILING_ERROR = 561002
ACLNN_ERR_INNER_FIND_KERNEL_ERROR = 561003
ACLNN_ERR_INNER_CREATE_EXECUTOR = 561101
ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR = 561102
ACLNN_ERR_INNER_NULLPTR = 561103

STATUS_NAMES = {
    value: name for name, value in globals().items() if name.startswith("ACLNN_")
}


class AclnnError(ValueError):
    """Bad input to an attngrad operator.

    ``status`` is the CANN status the aclnn layer returns for the same input;
    ``param`` names the offending parameter (or ``None`` for a rule across several).
    """

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param

    def __str__(self) -> str:
        return f"[{STATUS_NAMES.get(self.status, self.status)} {self.status}] {self.args[0]}"


def aclnn_error_of(exc: BaseException) -> AclnnError | None:
    """The :class:`AclnnError` behind ``exc``: ``exc`` itself, or the one found along its ``__cause__`` /
    ``__context__`` chain. Under ``torch.compile`` an operator's validation runs while dynamo traces the graph,
    and dynamo re-raises the error as its own ``TorchRuntimeError``; the AclnnError stays in that chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, AclnnError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
