"""A Python executor (the sortie_client package) for tests/tests/python_client.rs.

    python refund_executor.py [--hang-after-send] <sortie_client.ExecutorConfig flags>

Two tools, both POSTing the step's arguments to `config.url` (the test's `sortie ledger`)
with the operation id as the Idempotency-Key:

- `refund`: the refund story's step; answers `{"refund_id": ..., "receipt": ...}`;
- `http`: the contract of the Rust executor's built-in `http` handler, for the
  conformance cases that run the same graph against both executors: the receiver's JSON
  answer as output; 429 and 5xx retryable (with Retry-After), other 4xx permanent, a
  refused connection retryable, anything else after sending unknown; status lookups from
  `GET {config.status_url}/{operation_id}` (200 found, 404 not found).

With `--hang-after-send` a tool says "refund sent" on stdout after the ledger answered and
then hangs, so the test can kill the process mid-call: after the receiver acted, before
the result was reported.
"""

import json
import logging
import sys
import time
import urllib.error
import urllib.request

from sortie_client import Executor, Found, NotFound, Permanent, Retryable, Unknown

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("httpx").setLevel(logging.WARNING)
logging.getLogger("httpx2").setLevel(logging.WARNING)

argv = sys.argv[1:]
hang = "--hang-after-send" in argv
argv = [a for a in argv if a != "--hang-after-send"]
executor = Executor.from_args(argv)


def post(call):
    """The receiver's JSON answer, or the error that classifies its failure."""
    request = urllib.request.Request(
        call.config["url"],
        data=json.dumps(call.args).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": call.operation_id},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=call.timeout) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as e:
        if e.code == 429 or e.code >= 500:
            after = e.headers.get("Retry-After")
            raise Retryable(f"http_{e.code}", str(e.reason),
                            retry_after=float(after) if after and after.isdigit() else None)
        raise Permanent(f"http_{e.code}", str(e.reason))
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            raise Retryable("connection_refused", str(e.reason))
        raise Unknown("connection_lost", str(e.reason))
    if hang:
        print(f"refund sent for {call.operation_id} attempt {call.attempt}; hanging", flush=True)
        time.sleep(600)
    return answer


@executor.handler("refund")
def refund(call):
    receipt = post(call)
    return {"refund_id": f"rf-{receipt['ledger_seq']}", "receipt": receipt}


@executor.handler("http")
def http(call):
    return post(call)


@executor.lookup("http")
def http_status(call):
    url = f"{call.config['status_url'].rstrip('/')}/{call.operation_id}"
    try:
        with urllib.request.urlopen(url, timeout=call.timeout) as response:
            return Found(json.load(response).get("output"))
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return NotFound()
        raise Retryable(f"http_{e.code}", str(e.reason))


executor.run()
