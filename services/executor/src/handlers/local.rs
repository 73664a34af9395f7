//! `echo` and `sleep`: handlers without a receiver, for demos and tests.

use std::time::Duration;

use serde_json::Value;

use crate::handler::{Call, HandlerError, StepHandler};

/// `echo`: the output is the step's args.
#[derive(Debug, Clone, Copy, Default)]
pub struct Echo;

impl StepHandler for Echo {
    async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        Ok(call.args.clone())
    }
}

/// `sleep`: waits `args.ms` (or `config.ms`) milliseconds, then answers
/// `{"slept_ms": ms}`. Past the call's timeout it gives up with an unknown outcome, like
/// a receiver that did not answer in time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sleep;

impl StepHandler for Sleep {
    async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        let ms = call.args["ms"]
            .as_u64()
            .or_else(|| call.config["ms"].as_u64())
            .ok_or_else(|| {
                HandlerError::permanent("bad_args", "sleep needs args.ms or config.ms")
            })?;
        let wanted = Duration::from_millis(ms);
        if wanted > call.timeout {
            tokio::time::sleep(call.timeout).await;
            return Err(HandlerError::unknown(
                "timeout",
                format!(
                    "slept {:?}, the attempt's timeout, of {wanted:?}",
                    call.timeout
                ),
            ));
        }
        tokio::time::sleep(wanted).await;
        Ok(serde_json::json!({ "slept_ms": ms }))
    }
}

#[cfg(test)]
mod tests {
    use sortie_wire::records::SideEffectClass;

    use super::*;

    fn call(args: Value, timeout_ms: u64) -> Call {
        Call {
            operation_id: "op".into(),
            attempt: 1,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: "s#1".into(),
            node: "s".into(),
            tool: "sleep".into(),
            side_effect: SideEffectClass::Pure,
            args,
            config: serde_json::json!({}),
            timeout: Duration::from_millis(timeout_ms),
            progress: Default::default(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn echo_returns_its_args_and_sleep_sleeps_within_its_timeout() {
        let args = serde_json::json!({"a": [1, 2]});
        assert_eq!(Echo.call(&call(args.clone(), 10)).await, Ok(args));
        assert_eq!(
            Sleep.call(&call(serde_json::json!({"ms": 50}), 1000)).await,
            Ok(serde_json::json!({"slept_ms": 50}))
        );
        assert!(Sleep
            .call(&call(serde_json::json!({"ms": 5000}), 1000))
            .await
            .expect_err("too long")
            .is_unknown());
        assert_eq!(
            Sleep
                .call(&call(serde_json::json!({}), 1000))
                .await
                .expect_err("no ms")
                .code(),
            "bad_args"
        );
    }
}
