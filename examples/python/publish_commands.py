"""Publish Sortie run commands from another service with the `sortie_client` package
(`pip install ./clients/python`): confluent-kafka, the Avro serializer and the schema
registry underneath.

    python publish_commands.py --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081 \
        start --run-id run-42 --graph refund --input '{"order_id": "o-42"}'
    python publish_commands.py ... approve --run-id run-42 --interrupt-id int_... --proposal-hash ...
    python publish_commands.py ... cancel --run-id run-42 --reason "customer asked"
    python publish_commands.py ... --principal svc:logistics --role logistics \
        signal --run-id run-42 --name laptop_delivered --payload '{"tracking": "1Z999"}'
    python publish_commands.py ... signal --correlated onboarding hire_id h-42 \
        --name laptop_delivered --payload '{"tracking": "1Z999"}'
    python publish_commands.py --wait ...   # and print the reducer's answer

What the package does for Sortie:
  * the record key is the run id, on the partition the Java client's partitioner gives
    it (murmur2), where Sortie reads it;
  * `command_id` makes a command idempotent: send it again and it is applied once (a
    signal's `--signal-id` does the same across command ids: resend an event under a new
    command id and its run takes it once);
  * with `--signing-key` (a key file from `sortie keys new`), the record carries an
    Ed25519 signature over its exact value bytes (headers `sortie-key`,
    `sortie-signature`): reducers started with `--require-signatures` take only signed
    commands, by a key of their keyring that may sign as `--principal` for `--tenant`
    with `--role`s;
  * with `--wait`, it reads the run's run-events partition from its end offset taken
    *before* producing, until the CommandAccepted or CommandRejected carrying this
    command_id, prints it, and exits 3 if the command was rejected. A signal its run takes
    is followed by SignalReceived (or SignalBuffered, kept for a wait not open yet); one
    it refuses is answered `unknown_signal`, `forbidden`, `invalid_payload`, `not_waiting`, ...
"""

import argparse
import json
import sys

from sortie_client import Client, Connection, correlated_run_id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--registry", default="http://127.0.0.1:8081")
    parser.add_argument("--prefix", default="sortie.")
    parser.add_argument("--tenant", default="dev")
    parser.add_argument("--principal", default="svc:python-example")
    parser.add_argument("--role", action="append", default=[])
    parser.add_argument("--command-id", default=None, help="defaults to a new UUID")
    parser.add_argument("--signing-key", default=None,
                        help="sign the command with this key file (sortie keys new)")
    parser.add_argument("--wait", action="store_true",
                        help="wait for the reducer's answer; exit 3 if it rejects the command")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start")
    start.add_argument("--run-id", required=True)
    start.add_argument("--graph", required=True)
    start.add_argument("--graph-version", type=int, default=None)
    start.add_argument("--input", default="{}")
    for name in ("approve", "reject"):
        decide = sub.add_parser(name)
        decide.add_argument("--run-id", required=True)
        decide.add_argument("--interrupt-id", required=True)
        decide.add_argument("--proposal-hash", required=True)
        decide.add_argument("--comment", default=None)
    cancel = sub.add_parser("cancel")
    cancel.add_argument("--run-id", required=True)
    cancel.add_argument("--reason", default=None)
    signal = sub.add_parser("signal")
    target = signal.add_mutually_exclusive_group(required=True)
    target.add_argument("--run-id")
    target.add_argument("--correlated", nargs=3, metavar=("GRAPH", "LABEL", "VALUE"),
                        help="the run of GRAPH (which declares correlation: LABEL) whose label is VALUE")
    signal.add_argument("--name", required=True, help="the signal the run's wait names")
    signal.add_argument("--payload", default=None, help="JSON (default null)")
    signal.add_argument("--signal-id", default=None,
                        help="your id of this event, taken once per run (default: the command id)")
    args = parser.parse_args()
    if getattr(args, "correlated", None):
        args.run_id = correlated_run_id(args.tenant, *args.correlated)

    client = Client(
        Connection(bootstrap_servers=args.bootstrap, registry_url=args.registry, prefix=args.prefix),
        tenant=args.tenant,
        principal=args.principal,
        roles=args.role,
        signing_key=args.signing_key,
    )
    common = {"command_id": args.command_id, "wait": args.wait}
    try:
        if args.command == "start":
            answer = client.start(args.run_id, args.graph, json.loads(args.input),
                                  graph_version=args.graph_version, **common)
        elif args.command in ("approve", "reject"):
            decide = client.approve if args.command == "approve" else client.reject
            answer = decide(args.run_id, args.interrupt_id, args.proposal_hash, comment=args.comment, **common)
        elif args.command == "cancel":
            answer = client.cancel(args.run_id, args.reason, **common)
        else:
            payload = None if args.payload is None else json.loads(args.payload)
            answer = client.signal(args.run_id, args.name, payload, signal_id=args.signal_id, **common)
    except Exception as e:  # noqa: BLE001 - the one line a caller reads
        print(json.dumps({"error": str(e)}))
        return 1
    line = {"command_id": answer.command_id, "run_id": answer.run_id, "topic": args.prefix + "commands",
            "partition": answer.partition, "offset": answer.offset}
    if args.wait:
        line.update(accepted=answer.accepted, duplicate=answer.duplicate, code=answer.code, reason=answer.reason)
    print(json.dumps(line))
    return 0 if answer.accepted or not args.wait else 3


if __name__ == "__main__":
    sys.exit(main())
