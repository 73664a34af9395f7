"""The package's logic that needs no broker: `python -m unittest discover clients/python/tests`
(tests/tests/python_client.rs runs it)."""

import base64
import os
import tempfile
import unittest

from sortie_client import Found, NotFound, Permanent, RecordedFailed, Retryable, Unknown
from sortie_client.client import correlated_run_id, load_signing_key
from sortie_client.executor import Call, Executor, _OperationLocks, _Output, _Tracker, _attempt_deadline
from sortie_client.follower import Chain, ChainBroken, Event
from sortie_client.wire import murmur2, partition_for, read_properties


class Murmur2(unittest.TestCase):
    def test_the_java_clients_vectors(self):
        # org.apache.kafka.common.utils.UtilsTest
        for text, expected in [
            ("21", -973932308),
            ("foobar", -790332482),
            ("a-little-bit-long-string", -985981536),
            ("a-little-bit-longer-string", -1486304829),
            ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
            ("abc", 479470107),
        ]:
            self.assertEqual(murmur2(text.encode()), expected, text)
        self.assertEqual(partition_for("run-py", 3), 2)


class Deadline(unittest.TestCase):
    def test_an_attempts_deadline_is_its_issue_time_plus_its_timeout(self):
        import datetime

        self.assertEqual(_attempt_deadline({"issued_at": 1000, "timeout_ms": 2000}), 3000)
        at = datetime.datetime.fromtimestamp(1.5, tz=datetime.timezone.utc)
        self.assertEqual(_attempt_deadline({"issued_at": at, "timeout_ms": 500}), 2000)
        for no_timeout in (None, 0, -1):
            self.assertIsNone(_attempt_deadline({"issued_at": 1000, "timeout_ms": no_timeout}))


class Tracker(unittest.TestCase):
    def test_a_commit_never_passes_an_offset_in_flight(self):
        t = _Tracker(1)
        for offset in (10, 11, 13):
            t.track(offset)
        t.pending.discard(11)
        t.pending.discard(13)
        self.assertEqual(t.to_commit(), 10)
        t.pending.discard(10)
        self.assertEqual(t.to_commit(), 14)
        t.was_committed(14)
        self.assertIsNone(t.to_commit())

    def test_waiters_go_on_only_once_a_commit_covers_them(self):
        import threading

        t = _Tracker(1)
        for offset in (5, 6):
            t.track(offset)
        event, verdict = threading.Event(), []
        t.pending.discard(6)
        t.waiters[6] = (event, verdict)
        self.assertEqual(t.to_commit(), 5)
        t.was_committed(5)
        self.assertFalse(event.is_set())
        t.pending.discard(5)
        t.was_committed(t.to_commit())
        self.assertEqual(verdict, [True])

    def test_handed_back_waiters_are_pending_again(self):
        import threading

        t = _Tracker(1)
        t.track(1)
        t.track(2)
        event, verdict = threading.Event(), []
        t.pending.discard(2)
        t.waiters[2] = (event, verdict)
        t.hand_back()
        self.assertEqual(verdict, [False])
        t.pending.discard(1)
        self.assertEqual(t.to_commit(), 2)


def call(attempt, config=None):
    return Call("op-1", attempt, "t", "r", "pay#1", "pay", "pay", "RECONCILABLE", {}, config or {}, 1.0)


class Settle(unittest.TestCase):
    """`dispatch.rs::settle` and `only_ask`, reproduced."""

    def executor(self, answer):
        executor = Executor()
        executor.handler("pay")(lambda c: {})
        if answer is not None:
            def lookup(c):
                if isinstance(answer, Exception):
                    raise answer
                return answer
            executor.lookup("pay")(lookup)
        return executor

    def code(self, outcome):
        if outcome is None:
            return "call"
        if isinstance(outcome, _Output):
            return "ok"
        return type(outcome).__name__.lower() + ":" + outcome.code

    def test_ask_first(self):
        auth = {"lookup_authoritative": True}
        cases = [
            (Found({"x": 1}), 2, None, "ok"),
            (NotFound(), 1, None, "call"),
            (NotFound(), 2, None, "unknown:lookup_not_found"),
            (NotFound(), 2, {"lookup_authoritative": "true"}, "unknown:lookup_not_found"),
            (NotFound(), 2, auth, "call"),
            (RecordedFailed("declined"), 2, None, "call"),
            (None, 1, None, "call"),
            (None, 2, None, "unknown:not_reconcilable"),
            (Retryable("x"), 2, auth, "unknown:lookup_failed"),
            (Permanent("x"), 2, auth, "permanent:x"),
        ]
        for answer, attempt, config, expected in cases:
            got = self.code(self.executor(answer)._ask_first(call(attempt, config)))
            self.assertEqual(got, expected, (answer, attempt, config))

    def test_only_ask_never_calls(self):
        auth = {"lookup_authoritative": True}
        cases = [
            (Found({"x": 1}), None, "ok"),
            (RecordedFailed("declined"), None, "permanent:declined"),
            (NotFound(), auth, "permanent:not_performed"),
            (NotFound(), None, "unknown:lookup_not_found"),
            (None, auth, "unknown:not_reconcilable"),
            (Permanent("x"), auth, "unknown:lookup_failed"),
        ]
        for answer, config, expected in cases:
            got = self.code(self.executor(answer)._only_ask(call(2, config)))
            self.assertEqual(got, expected, (answer, config))

    def test_an_overtaken_attempt_does_not_get_the_operation(self):
        locks = _OperationLocks()
        locks.acquire("op-1", 2)()
        self.assertIsNone(locks.acquire("op-1", 1))
        self.assertIsNotNone(locks.acquire("op-1", 2))

    def test_sealed_and_blob_arguments_are_refused_before_any_call(self):
        executor = self.executor(None)
        intent = {
            "operation_id": "op", "attempt": 1, "tenant": "t", "run_id": "r", "step_id": "s",
            "node": "n", "tool": "pay", "side_effect": "UNSAFE", "config": "{}", "timeout_ms": None,
        }
        for args, code in [
            ('{"a": {"$sealed": "v1.abc"}}', "unsealable"),
            ("null", "unsealable"),
            ('{"a": {"$blob": "sortie-blob:t/r/00", "sha256": "00", "size": 1}}', "blob_unsupported"),
            ("{nope", "bad_args"),
        ]:
            with self.assertRaises(Permanent) as raised:
                executor._call(dict(intent, args=args))
            self.assertEqual(raised.exception.code, code)
        with self.assertRaises(Permanent) as raised:
            executor._call(dict(intent, args="{}", tool="other"))
        self.assertEqual(raised.exception.code, "unknown_tool")


def event(run, seq, prev, hash_):
    return Event("t", run, seq, 1, None, None, None, prev, hash_, "X", {})


class Chains(unittest.TestCase):
    def test_links_are_checked(self):
        chain = Chain()
        chain.check(event("a", 1, None, "h1"))
        chain.check(event("b", 1, None, "g1"))
        chain.check(event("a", 2, "h1", "h2"))
        for bad in [event("a", 4, "h2", "h4"), event("a", 3, "hX", "h3"), event("a", 2, "h1", "h2")]:
            with self.assertRaises(ChainBroken):
                chain.check(bad)
        chain.check(event("a", 3, "h2", "h3"))


class Files(unittest.TestCase):
    def test_properties_and_key_files(self):
        with tempfile.TemporaryDirectory() as d:
            props = os.path.join(d, "kafka.properties")
            with open(props, "w") as f:
                f.write("# SASL\nsecurity.protocol=SASL_SSL\n\nsasl.password = a=b\n! also\n")
            self.assertEqual(read_properties(props), {"security.protocol": "SASL_SSL", "sasl.password": "a=b"})
            key = os.path.join(d, "k.key")
            with open(key, "w") as f:
                f.write(f"id: k-1\nsecret_key: {base64.b64encode(bytes(32)).decode()}\n")
            key_id, signer = load_signing_key(key)
            self.assertEqual(key_id, "k-1")
            self.assertEqual(len(signer.sign(b"x")), 64)

    def test_correlated_run_ids(self):
        self.assertTrue(correlated_run_id("dev", "onboarding", "hire_id", "h-42").startswith("cor_"))


if __name__ == "__main__":
    unittest.main()
