"""A Python service drives runs through the sortie_client package, for
tests/tests/python_client.rs: start (and the same start again), signal, approve, cancel,
a refused decision and an unsigned command, each answer printed as one JSON line; a
Follower reads the runs' events with their chain checked.

    python client_story.py --bootstrap H:P --registry URL --prefix P --key FILE
"""

import argparse
import json
import sys

from sortie_client import Client, Connection, Follower


def say(what, answer=None, **extra):
    line = {"step": what, **extra}
    if answer is not None:
        line.update(
            command_id=answer.command_id, accepted=answer.accepted, duplicate=answer.duplicate,
            code=answer.code, partition=answer.partition,
        )
    print(json.dumps(line), flush=True)


def until(follower, run_id, test, timeout=60):
    seen = []
    for event in follower.run(run_id, timeout=timeout):
        seen.append(event)
        if test(event):
            return event, seen
    raise SystemExit(f"{run_id}: not seen in {timeout} s; saw {[e.kind for e in seen]}")


def status_is(status):
    return lambda e: e.kind == "RunStatusChanged" and e.fields.get("status") == status


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--registry", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--key", required=True)
    a = p.parse_args()
    conn = Connection(bootstrap_servers=a.bootstrap, registry_url=a.registry, prefix=a.prefix)
    client = Client(conn, tenant="acme", principal="svc:shop", roles=["approver"], signing_key=a.key)
    follower = Follower(conn)

    started = client.start("run-a", "py_client", {"name": "Ada"})
    say("start", started)
    say("start again", client.start("run-a", "py_client", {"name": "Ada"}, command_id=started.command_id))
    until(follower, "run-a", status_is("WAITING_SIGNAL"))
    say("signal", client.signal("run-a", "laptop_delivered", {"tracking": "1Z999"}, signal_id="dlv-1"))
    interrupted, _ = until(follower, "run-a", lambda e: e.kind == "Interrupted")
    say("wrong proposal", client.approve("run-a", interrupted.fields["interrupt_id"], "0" * 64))
    say("approve", client.approve(
        "run-a", interrupted.fields["interrupt_id"], interrupted.fields["proposal_hash"],
        comment="looks right"))
    _, events = until(follower, "run-a", status_is("SUCCEEDED"))
    say("run-a history", kinds=[e.kind for e in events], seqs=[e.seq for e in events],
        output=events[-1].fields.get("output"))

    say("start b", client.start("run-b", "py_client", {"name": "Grace"}))
    say("cancel b", client.cancel("run-b", "customer asked"))
    until(follower, "run-b", status_is("CANCELLED"))

    unsigned = Client(conn, tenant="acme", principal="svc:shop", roles=["approver"])
    say("unsigned start", unsigned.start("run-c", "py_client", {"name": "Eve"}))

    runs = {}
    for event in follower.tenant("acme", timeout=5):
        runs.setdefault(event.run_id, []).append(event.seq)
    say("tenant", runs={r: s for r, s in runs.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
