"""The error every HTTP handler raises: a status plus OpenAI's `{"error": {...}}` body.

Its own module because every layer of the server raises it (request models, the Responses and
Anthropic translations, jobs, routes), and none of them should pull in the request models to do so.
Wrong types and bad values are 400 `invalid_request_error` (OpenAI's and vLLM's code).
"""

from __future__ import annotations


class APIError(Exception):
    """An error with an HTTP status, rendered as OpenAI's {"error": {...}} body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
