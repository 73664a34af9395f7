"""A dashboard's view of Sortie: follow the run-events topic with the `sortie_client`
package (`pip install ./clients/python`) and print every event as one JSON line, live.

    python dashboard.py --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081
    python dashboard.py ... --run run-42 --until SUCCEEDED --timeout 60
    python dashboard.py ... --tenant dev

Events of a run arrive in order (`seq` 1, 2, ...): the topic is keyed by run id, and the
Follower checks each event's links (`seq` one past the last, `prev_hash` the last one's
`hash`), so a gap or a spliced event stops it. The `event` field names the kind
(RunStarted, StepDispatched, Interrupted, ...) and the rest are that kind's fields; JSON
payloads (input, args, outputs) are printed as the JSON strings the records carry.
"""

import argparse
import json
import sys

from sortie_client import Connection, Follower

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--registry", default="http://127.0.0.1:8081")
    parser.add_argument("--prefix", default="sortie.")
    parser.add_argument("--run", default=None, help="only this run's events")
    parser.add_argument("--tenant", default=None, help="only this tenant's runs")
    parser.add_argument("--until", default=None,
                        help="exit 0 once the run reaches this status (or WAITING_APPROVAL, any terminal one)")
    parser.add_argument("--timeout", type=float, default=0, help="give up (exit 1) after this many seconds")
    args = parser.parse_args()

    follower = Follower(
        Connection(bootstrap_servers=args.bootstrap, registry_url=args.registry, prefix=args.prefix),
        decode_payloads=False,
    )
    timeout = args.timeout or None
    events = follower.run(args.run, timeout=timeout) if args.run else follower.tenant(args.tenant, timeout=timeout)
    for event in events:
        line = {"run_id": event.run_id, "seq": event.seq, "at": str(event.at), "event": event.kind, **event.fields}
        print(json.dumps(line, default=str), flush=True)
        status = event.fields.get("status") if event.kind == "RunStatusChanged" else None
        if args.until and status and (status == args.until or status in TERMINAL):
            return 0 if status == args.until else 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
