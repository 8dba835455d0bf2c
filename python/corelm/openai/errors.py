"""The API's errors, shared by protocol.py and tools.py: the server answers APIError.status with its body(),
a batch file writes an error line."""
from __future__ import annotations

from typing import Any, Dict, Optional


class APIError(Exception):
    """A request the API refuses. The server answers {"error": {message, type, param, code}} with
    `status`; a batch file gets an error line {"code", "message"}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)
