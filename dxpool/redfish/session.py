"""One logged-in session with a Redfish service, and its errors as driver errors.

Built on DMTF's python-redfish-library (``redfish``). We chose it over OpenStack's
``sushy`` after reading both clients' source:

* its calls return the response whatever the status, and take the caller's headers
  as given, so an ``If-Match`` PATCH stays conditional. ``sushy``'s ``patch(etag=...)``
  answers a 412 by sending the PATCH again *without* ``If-Match``, which would overwrite
  a zone that changed underneath - the very race the ETag is there to catch;
* its resend-on-error is a per-call count we set to zero, so whether a request is
  safe to repeat is decided here (see :mod:`tenacity` in the mapper), whereas ``sushy``
  resends any timed-out request at least three times, sleeping two seconds each time;
* it is DMTF's own reference client, small, and brings no OpenStack plumbing (pbr,
  stevedore).

What it lacks we add: a 401 on an expired session logs in again once and repeats the
request; TLS verification is on by default (the library verifies only when given a CA
file, so without ``ca_bundle`` we hand it the bundled public CAs of ``requests``); a
resource's ETag is read from the ``ETag`` header or, where a service gives it only in the
payload, from ``@odata.etag`` (DSP0266 allows either); an answer's ``Location`` and
``Retry-After`` are kept for following task monitors (:mod:`dxpool.redfish.tasks`).
Authentication is a Redfish session (``X-Auth-Token``) or HTTP Basic, as the map says.

Errors (the tree)::

    RedfishError                 a Redfish call failed; ``retryable`` says if redoing the
    │                            operation from a fresh read can help
    ├── RedfishStatusError       the service answered an HTTP error; ``status`` is the code
    │                            and the message carries the service's own
    │                            ``@Message.ExtendedInfo`` text. Retryable for 5xx, 412 and
    │                            429, not for other 4xx
    ├── RedfishUnreachableError  no answer (connection refused, TLS failure, timeout).
    │                            Retryable, except a TLS verification failure, which only
    │                            configuration fixes
    └── RedfishLoginError        no session could be opened; not retryable when the service
                                 refused the credentials

The callers turn them into their own errors (the host agent's ``DriverError``, the
broker's ``BoxFabricError``); this module knows neither.
"""

from __future__ import annotations

import datetime
import email.utils
import logging
import threading
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import redfish
import requests.utils
from redfish.rest.v1 import (
    InvalidCredentialsError,
    RetriesExhaustedError,
    ServerDownOrUnreachableError,
    SessionCreationError,
)

from dxpool.redfish.fabric_map import AuthMethod, RedfishService

log = logging.getLogger(__name__)
# The library logs every request at INFO (attempt counts, response times); the mapper's
# own log lines say what happened, so only the library's warnings and errors pass.
logging.getLogger("redfish.rest.v1").setLevel(logging.WARNING)

RETRYABLE_4XX = frozenset({HTTPStatus.PRECONDITION_FAILED, HTTPStatus.TOO_MANY_REQUESTS})


class RedfishError(Exception):
    """A Redfish call failed. ``retryable`` is False when redoing it cannot succeed."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


class RedfishStatusError(RedfishError):
    """The service answered ``status``; retryable for 5xx, 412 and 429. ``message_ids``
    are the ``MessageId`` values of its ``@Message.ExtendedInfo``."""

    def __init__(self, message: str, status: int, message_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message, retryable=status >= 500 or status in RETRYABLE_4XX)
        self.status = status
        self.message_ids = message_ids


class RedfishUnreachableError(RedfishError):
    """The service gave no answer."""


class RedfishLoginError(RedfishError):
    """No session could be opened (refused credentials are not retryable)."""


@dataclass(frozen=True)
class RedfishResource:
    """A resource as read: its JSON body and its ETag ("" when the service gives none)."""

    body: dict[str, Any]
    etag: str


@dataclass(frozen=True)
class RedfishReply:
    """An answer that may carry no resource: its status, its JSON body ({} when none),
    its ``Location`` header ("" when none; a task monitor for a 202) and its
    ``Retry-After`` in seconds (None when absent or unreadable)."""

    status: int
    body: dict[str, Any]
    location: str = ""
    retry_after_s: float | None = None


class RedfishSession:
    """A session-authenticated client for one Redfish service; safe for several threads
    (requests are sent one at a time: the session token is shared state).

    ``get``, ``patch``, ``post`` and ``poll`` send one request each - never repeated here
    except after a re-login - and raise the errors above. ``close`` deletes the session at
    the service.
    """

    def __init__(self, service: RedfishService) -> None:
        self._service = service
        self._lock = threading.Lock()
        if not service.verify:
            cafile = None
            log.warning("redfish TLS verification is off", extra={"url": service.url})
        elif service.ca_bundle is not None:
            cafile = str(service.ca_bundle)
        else:
            cafile = requests.utils.DEFAULT_CA_BUNDLE_PATH
        self._client = redfish.redfish_client(
            base_url=service.url,
            username=service.username,
            password=service.password,
            cafile=cafile,
            timeout=service.timeout_s,
            max_retry=0,
            check_connectivity=False,
        )
        with self._lock:
            self._login()

    @property
    def url(self) -> str:
        return self._service.url

    def get(self, path: str, query: dict[str, str] | None = None) -> RedfishResource:
        """The resource at ``path`` (with the query parameters ``query``)."""
        response = self._send("GET", path, query=query)
        body = _json(response, "GET", path)
        return RedfishResource(body=body, etag=_etag(response, body))

    def patch(self, path: str, body: dict[str, Any], etag: str) -> RedfishResource:
        """PATCH ``body`` onto ``path``, conditional on ``etag`` when it is not empty (412
        when the resource changed since). Returns the resource as the service answered."""
        headers = {"If-Match": etag} if etag else None
        response = self._send("PATCH", path, body=body, headers=headers)
        payload = _optional_json(response)
        return RedfishResource(body=payload, etag=_etag(response, payload))

    def post(self, path: str, body: dict[str, Any]) -> RedfishReply:
        """POST ``body`` to ``path`` (an action's target). Sent once: an action is not
        assumed safe to repeat, so the caller decides."""
        return _reply(self._send("POST", path, body=body))

    def poll(self, path: str) -> RedfishReply:
        """GET ``path`` as a task monitor: a 202 (still running, body may be empty) is
        an answer like any other, not an error; 4xx and 5xx raise."""
        return _reply(self._send("GET", path))

    def close(self) -> None:
        """Delete the session at the service; errors are logged, not raised."""
        with self._lock:
            try:
                self._client.logout()
            except Exception as error:
                log.warning("redfish logout failed", extra={"url": self.url, "error": str(error)})

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        query: dict[str, str] | None = None,
    ) -> Any:
        with self._lock:
            response = self._request(method, path, body, headers, query)
            if response.status == HTTPStatus.UNAUTHORIZED:
                log.info("redfish session expired; logging in again", extra={"url": self.url})
                self._login()
                response = self._request(method, path, body, headers, query)
                if response.status == HTTPStatus.UNAUTHORIZED:
                    raise RedfishStatusError(
                        f"{self.url} refused {method} {path} right after a fresh login (401): "
                        f"check the rights of Redfish user {self._service.username!r}",
                        HTTPStatus.UNAUTHORIZED,
                    )
        if response.status >= 400:
            raise RedfishStatusError(
                f"{self.url} answered {response.status} to {method} {path}: "
                f"{_service_message(response)}",
                response.status,
                _message_ids(response),
            )
        return response

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        headers: dict[str, str] | None,
        query: dict[str, str] | None = None,
    ) -> Any:
        try:
            if method == "GET":
                return self._client.get(path, args=query, headers=headers)
            if method == "POST":
                return self._client.post(path, body=body, headers=headers)
            return self._client.patch(path, body=body, headers=headers)
        except RetriesExhaustedError as error:
            raise _unreachable(self.url, f"{method} {path}", error.__cause__ or error) from error

    def _login(self) -> None:
        basic = self._service.auth is AuthMethod.BASIC
        try:
            self._client.login(
                auth=redfish.AuthMethod.BASIC if basic else redfish.AuthMethod.SESSION
            )
        except InvalidCredentialsError as error:
            raise RedfishLoginError(
                f"{self.url} refused the credentials of Redfish user "
                f"{self._service.username!r}: fix username or password_file in the fabric map",
                retryable=False,
            ) from error
        except SessionCreationError as error:
            raise RedfishLoginError(
                f"{self.url} could not open a Redfish session ({error}); if the service has "
                "no session service, set service.auth: basic in the fabric map"
            ) from error
        except ServerDownOrUnreachableError as error:
            raise RedfishLoginError(
                f"{self.url} could not open a Redfish session: {error}"
            ) from error
        except RetriesExhaustedError as error:
            raise _unreachable(self.url, "login", error.__cause__ or error) from error


def _unreachable(url: str, what: str, cause: BaseException) -> RedfishUnreachableError:
    if isinstance(cause, requests.exceptions.SSLError):
        error = RedfishUnreachableError(
            f"TLS with {url} failed during {what}: {cause}; set service.ca_bundle to the CA "
            "that signed the service's certificate",
        )
        error.retryable = False
        return error
    if isinstance(cause, requests.exceptions.Timeout):
        return RedfishUnreachableError(f"{url} did not answer {what} in time ({cause})")
    return RedfishUnreachableError(f"{url} is unreachable for {what}: {cause}")


def _json(response: Any, method: str, path: str) -> dict[str, Any]:
    try:
        payload = response.dict
    except Exception as error:
        raise RedfishStatusError(
            f"{method} {path} answered {response.status} with a body that is not JSON",
            response.status,
        ) from error
    if not isinstance(payload, dict) or not payload:
        raise RedfishStatusError(
            f"{method} {path} answered {response.status} without a JSON object",
            response.status,
        )
    return payload


def _optional_json(response: Any) -> dict[str, Any]:
    """The JSON object of an answer that may have none (204 No Content, an empty 202)."""
    try:
        payload = response.dict
    except Exception:
        return {}
    return payload if isinstance(payload, dict) else {}


def _reply(response: Any) -> RedfishReply:
    location = response.getheader("Location")
    return RedfishReply(
        status=response.status,
        body=_optional_json(response),
        location=str(location or ""),
        retry_after_s=retry_after(response.getheader("Retry-After")),
    )


def _etag(response: Any, body: dict[str, Any]) -> str:
    """The ETag of a resource: the ``ETag`` header, else the payload's ``@odata.etag``."""
    value = response.getheader("ETag")
    if value:
        return str(value)
    annotated = body.get("@odata.etag")
    return annotated if isinstance(annotated, str) else ""


def retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header: delay-seconds or an HTTP date (RFC 9110);
    None when absent or unreadable. A date in the past is 0."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())


def _message_ids(response: Any) -> tuple[str, ...]:
    infos = _optional_json(response).get("error", {})
    infos = infos.get("@Message.ExtendedInfo") if isinstance(infos, dict) else None
    if not isinstance(infos, list):
        return ()
    return tuple(str(i["MessageId"]) for i in infos if isinstance(i, dict) and "MessageId" in i)


def _service_message(response: Any) -> str:
    """The service's own words: ``error.@Message.ExtendedInfo[].Message`` or
    ``error.message`` (DMTF's error response), else the reason phrase."""
    try:
        error = response.dict.get("error", {})
    except Exception:
        error = {}
    if isinstance(error, dict):
        infos = error.get("@Message.ExtendedInfo")
        if isinstance(infos, list):
            texts = [str(i["Message"]) for i in infos if isinstance(i, dict) and "Message" in i]
            if texts:
                return "; ".join(texts)
        if isinstance(error.get("message"), str):
            return str(error["message"])
    return (
        HTTPStatus(response.status).phrase
        if response.status in HTTPStatus._value2member_map_
        else ""
    )


__all__ = [
    "RedfishError",
    "RedfishLoginError",
    "RedfishReply",
    "RedfishResource",
    "RedfishSession",
    "RedfishStatusError",
    "RedfishUnreachableError",
    "retry_after",
]
