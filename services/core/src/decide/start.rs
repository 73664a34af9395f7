//! StartRun: create a run pinned to a graph version, or recognise the same request again.

use super::{advance, Ctx};
use crate::{
    event::EventBody,
    input::{Command, CommandBody},
};

pub(crate) fn handle(ctx: &mut Ctx<'_>, command: &Command) {
    let CommandBody::StartRun {
        graph_id,
        graph_version,
        input,
        labels,
        budget,
    } = &command.body
    else {
        return;
    };
    if let Some(run) = &ctx.state {
        // Same id + same request = same run; anything else under that id is a conflict.
        let same = run.tenant == command.tenant
            && &run.graph_id == graph_id
            && graph_version.is_none_or(|v| v == run.graph_version)
            && &run.input == input;
        if same {
            ctx.emit(
                EventBody::CommandAccepted {
                    command_id: command.command_id.clone(),
                    command: "StartRun".into(),
                    duplicate: true,
                },
                None,
            );
        } else if run.tenant != command.tenant {
            ctx.reject(
                command,
                "conflict",
                format!("run id {} is taken", command.run_id),
            );
        } else {
            ctx.reject(
                command,
                "conflict",
                format!(
                    "run {} already exists with a different request",
                    command.run_id
                ),
            );
        }
        return;
    }
    let Some(graph) = ctx.graphs.get(graph_id, *graph_version) else {
        let version = graph_version.map(|v| format!("@{v}")).unwrap_or_default();
        return ctx.reject(
            command,
            "unknown_graph",
            format!("graph {graph_id}{version} is not published"),
        );
    };
    ctx.emit(
        EventBody::RunStarted {
            graph_id: graph.id.clone(),
            graph_version: graph.version,
            input: input.clone(),
            started_by: command.principal.clone(),
            labels: labels.clone(),
            deadline_at: graph.max_duration.map(|d| ctx.at + d.0),
            budget: budget.clone(),
        },
        None,
    );
    ctx.accept(command);
    advance(ctx);
}
