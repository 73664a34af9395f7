//! One test per scenario file in `tests/scenarios/`: inputs → expected events and final
//! state, plus the determinism / event-sourcing / hash-chain checks of `support::run`.

mod support;

use std::path::PathBuf;

fn file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/scenarios")
        .join(format!("{name}.yaml"))
}

macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                support::run(&file(stringify!($name)));
            }
        )*

        #[test]
        fn every_scenario_file_has_a_test() {
            let listed = [$(stringify!($name)),*];
            for entry in std::fs::read_dir(file("x").parent().expect("dir")).expect("scenarios dir") {
                let path = entry.expect("entry").path();
                let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_owned();
                assert!(listed.contains(&stem.as_str()), "{} is not listed in scenarios!", path.display());
            }
        }
    };
}

scenarios!(
    sequence_completes,
    tool_loop_feeds_results_back,
    conditions_fan_out_and_join,
    retry_with_backoff,
    terminal_failure_compensates_in_reverse,
    unknown_outcome_by_side_effect_class,
    commands_are_deduplicated_and_checked,
    stale_and_duplicate_results_are_ignored,
    agent_loop_is_bounded,
    approval_gate,
    cancel_while_in_flight,
    late_result_resolves_unknown_outcome,
    rejection_runs_the_substitute_with_its_own_args,
    cancel_then_reconcilable_timeout_asks_the_receiver,
    cancel_then_reconcilable_never_performed_is_not_called,
    cancel_then_lookup_cannot_tell_hands_to_an_operator,
    cancel_then_timeout_by_side_effect_class,
    failure_then_unsafe_timeout_waits_for_an_operator,
    signal_wait_takes_one_signal_once,
    signal_before_its_wait_is_kept_and_taken,
    signal_deadline_fails_escalates_or_continues,
    signal_deadline_fails_the_run,
    correlated_runs_are_named_by_their_label,
    approver_groups_come_from_the_input,
);
