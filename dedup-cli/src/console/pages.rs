//! The console's pages: HTML rendered on the server, forms for actions, no script. Every
//! text that comes from the database goes through [`escape`].

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};

use super::api::{
    DeadQuery, ResolveBody, read_dead, read_overview, read_unknown, run_action, run_resolve,
};
use super::{Console, form};
use crate::ResolveAs;
use crate::actions::{ActionKind, FilterSpec, new_request_id};
use crate::text::{escape, human, thousands};

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1d1d1f}\
table{border-collapse:collapse;margin:.5rem 0 1.5rem}td,th{border:1px solid #ccc;padding:.3rem .6rem;\
text-align:left;vertical-align:top}th{background:#f3f3f3}td.n{text-align:right}\
pre{margin:0;max-width:60rem;max-height:16rem;overflow:auto;white-space:pre-wrap;word-break:break-all;\
background:#fafafa}.error{color:#a00}.note{background:#fff7d6;padding:.5rem;border:1px solid #e6c200}\
.done{background:#e6f6e6;padding:.5rem;border:1px solid #6a6}nav a{margin-right:1rem}\
form.inline{display:inline}button{margin:.2rem}";

/// A whole page.
pub(crate) fn page(status: StatusCode, title: &str, console: &Console, body: &str) -> Response {
    let read_only = if console.read_only {
        "<p class=\"note\">Read-only: this console changes nothing.</p>"
    } else {
        ""
    };
    let html = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{} · dedup console</title><style>{STYLE}</style></head><body>\
         <nav><a href=\"/\">Overview</a><a href=\"/unknown\">Unknown outcomes</a></nav>\
         <h1>{}</h1>{read_only}{body}</body></html>",
        escape(title),
        escape(title)
    );
    (
        status,
        [
            (header::CACHE_CONTROL, "no-store"),
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        Html(html),
    )
        .into_response()
}

fn age(seconds: f64) -> String {
    human(Duration::from_secs_f64(seconds.max(0.0)))
}

/// The hidden fields every action form carries: the form token and a request id made now.
fn hidden(console: &Console) -> String {
    format!(
        "<input type=\"hidden\" name=\"csrf\" value=\"{}\"><input type=\"hidden\" name=\"request_id\" value=\"{}\">",
        escape(&console.form_token),
        new_request_id()
    )
}

/// `GET /login`.
pub(crate) async fn login_form(State(console): State<Arc<Console>>) -> Response {
    page(
        StatusCode::OK,
        "Login",
        &console,
        "<form method=\"post\" action=\"/login\"><label>Token <input type=\"password\" name=\"token\" \
         autocomplete=\"current-password\"></label> <button type=\"submit\">Log in</button></form>",
    )
}

/// `GET /`.
pub(crate) async fn overview(State(console): State<Arc<Console>>) -> Response {
    let overview = read_overview(&console).await;
    let mut body = format!(
        "<p>{} · requeues keep to a redelivery window of {}</p>",
        escape(overview.backend),
        human(Duration::from_secs(overview.redelivery_window_s))
    );
    for queue in &overview.queues {
        let link = format!("/{}/{}", queue.queue, escape(&queue.table));
        let _ = write!(
            body,
            "<h2>{} <a href=\"{link}\">{}</a></h2>",
            queue.queue,
            escape(&queue.table)
        );
        if let Some(error) = &queue.error {
            let _ = write!(body, "<p class=\"error\">{}</p>", escape(error));
            continue;
        }
        if queue.consumers.is_empty() {
            body.push_str("<p>No rows.</p>");
            continue;
        }
        let done = if queue.queue == "inbox" {
            "processed"
        } else {
            "sent"
        };
        let _ = write!(
            body,
            "<table><tr><th>consumer</th><th>pending</th><th>in flight</th><th>{done}</th><th>dead</th><th>oldest pending</th></tr>"
        );
        for c in &queue.consumers {
            let dead = if c.dead > 0 {
                format!(
                    "<a href=\"{link}?consumer={}\">{}</a>",
                    escape(&urlencode(&c.consumer)),
                    thousands(c.dead)
                )
            } else {
                "0".to_owned()
            };
            let _ = write!(
                body,
                "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{dead}</td><td class=\"n\">{}</td></tr>",
                escape(&c.consumer),
                thousands(c.pending),
                thousands(c.in_flight),
                thousands(c.done),
                c.oldest_pending_s.map_or_else(|| "-".to_owned(), age),
            );
        }
        body.push_str("</table>");
    }
    let _ = write!(
        body,
        "<h2>Dedup table {}</h2>",
        escape(&overview.dedup.table)
    );
    if let Some(error) = &overview.dedup.error {
        let _ = write!(body, "<p class=\"error\">{}</p>", escape(error));
    } else if overview.dedup.consumers.is_empty() {
        body.push_str("<p>No ids.</p>");
    } else {
        body.push_str("<table><tr><th>consumer</th><th>ids</th><th>oldest</th><th>past the redelivery window</th><th>unresolved</th></tr>");
        for c in &overview.dedup.consumers {
            let unresolved = if c.unresolved > 0 {
                format!("<a href=\"/unknown\">{}</a>", thousands(c.unresolved))
            } else {
                "0".to_owned()
            };
            let _ = write!(
                body,
                "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{unresolved}</td></tr>",
                escape(&c.consumer),
                thousands(c.ids),
                age(c.oldest_s),
                thousands(c.past_window),
            );
        }
        body.push_str("</table><p>Ids past the redelivery window are what <code>dedup prune</code> deletes at that age.</p>");
    }
    page(StatusCode::OK, "dedup console", &console, &body)
}

/// Percent-encodes a query value.
fn urlencode(text: &str) -> String {
    serde_urlencoded::to_string([("v", text)])
        .map(|s| s.trim_start_matches("v=").to_owned())
        .unwrap_or_default()
}

/// `GET /{queue}/{table}`.
pub(crate) async fn dead(
    State(console): State<Arc<Console>>,
    Path((queue, table)): Path<(String, String)>,
    Query(query): Query<DeadQuery>,
) -> Response {
    let title = format!("Dead rows: {queue} {table}");
    let page_ = match read_dead(&console, &queue, &table, &query).await {
        Ok(page_) => page_,
        Err((status, detail)) => {
            return page(
                status,
                &title,
                &console,
                &format!("<p class=\"error\">{}</p>", escape(&detail)),
            );
        }
    };
    let spec = query.spec().unwrap_or_default();
    let value = |text: &Option<String>| escape(text.as_deref().unwrap_or(""));
    let action = format!("/{}/{}/act", escape(&queue), escape(&table));
    let mut body = format!(
        "<form method=\"get\"><label>consumer <input name=\"consumer\" value=\"{}\"></label> \
         <label>error contains <input name=\"error_contains\" value=\"{}\"></label> \
         <label>older than <input name=\"older_than\" value=\"{}\" placeholder=\"1h, 7d\" size=\"6\"></label> \
         <button type=\"submit\">Filter</button></form>\
         <p id=\"matching\">{}.</p>",
        value(&query.consumer),
        value(&query.error_contains),
        value(&query.older_than),
        if page_.total == 1 {
            "1 dead row matches".to_owned()
        } else {
            format!("{} dead rows match", thousands(page_.total))
        }
    );
    // Acting on everything the filter matches, not one page.
    if !console.read_only && page_.total > 0 {
        let filter_fields = format!(
            "<input type=\"hidden\" name=\"consumer\" value=\"{}\"><input type=\"hidden\" name=\"error_contains\" value=\"{}\">\
             <input type=\"hidden\" name=\"older_than_s\" value=\"{}\"><input type=\"hidden\" name=\"scope\" value=\"matching\">",
            escape(spec.consumer.as_deref().unwrap_or("")),
            escape(spec.error_contains.as_deref().unwrap_or("")),
            spec.older_than_s
                .map_or_else(String::new, |s| s.to_string()),
        );
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{action}\" class=\"inline\">{}{filter_fields}\
             <button type=\"submit\" name=\"kind\" value=\"requeue\" id=\"requeue-matching\">Requeue all {n} matching</button>\
             <button type=\"submit\" name=\"kind\" value=\"discard\" id=\"discard-matching\">Discard all {n} matching</button></form>",
            hidden(&console),
            n = thousands(page_.total),
        );
    }
    if page_.rows.is_empty() {
        body.push_str("<p>No dead rows here.</p>");
    } else {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{action}\">{}<input type=\"hidden\" name=\"scope\" value=\"selected\">",
            hidden(&console)
        );
        body.push_str("<table><tr><th></th><th>row</th><th>id</th><th>consumer</th><th>attempts</th><th>age</th><th>last error</th><th>payload</th><th>headers</th></tr>");
        for row in &page_.rows {
            let destination = row
                .destination
                .as_ref()
                .map_or_else(String::new, |d| format!("<br>to {}", escape(d)));
            let headers = if let Some(len) = row.opaque_headers_len {
                format!("{len} bytes")
            } else {
                row.headers
                    .iter()
                    .map(|(n, v)| format!("{}: {}", escape(n), escape(v)))
                    .collect::<Vec<_>>()
                    .join("<br>")
            };
            let cut = if row.payload_cut { ", first 4 KiB" } else { "" };
            let check = if console.read_only {
                String::new()
            } else {
                format!(
                    "<input type=\"checkbox\" name=\"row\" value=\"{}\" aria-label=\"select row {}\">",
                    row.row, row.row
                )
            };
            let _ = write!(
                body,
                "<tr id=\"row-{r}\"><td>{check}</td><td class=\"n\">{r}</td><td>{}{destination}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td>\
                 <td><pre class=\"last-error\">{}</pre></td><td>{} bytes, {}{cut}<pre class=\"payload\">{}</pre></td><td>{headers}</td></tr>",
                escape(&row.id),
                escape(&row.consumer),
                row.attempts,
                age(row.age_s),
                escape(row.last_error.as_deref().unwrap_or("")),
                row.payload_len,
                row.payload_kind,
                escape(&row.payload_preview),
                r = row.row,
            );
        }
        body.push_str("</table>");
        if !console.read_only {
            body.push_str("<button type=\"submit\" name=\"kind\" value=\"requeue\" id=\"requeue-selected\">Requeue selected</button>\
                <button type=\"submit\" name=\"kind\" value=\"discard\" id=\"discard-selected\">Discard selected</button>");
        }
        body.push_str("</form>");
        if let Some(after) = page_.next_after {
            let mut next = format!("?after={after}");
            for (name, value) in [
                ("consumer", &query.consumer),
                ("error_contains", &query.error_contains),
                ("older_than", &query.older_than),
            ] {
                if let Some(value) = value {
                    let _ = write!(next, "&{name}={}", urlencode(value));
                }
            }
            let _ = write!(body, "<p><a href=\"{}\">Next page</a></p>", escape(&next));
        }
    }
    page(StatusCode::OK, &title, &console, &body)
}

/// `POST /{queue}/{table}/act`: a form's requeue or discard.
pub(crate) async fn act(
    State(console): State<Arc<Console>>,
    Path((queue, table)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let fields = form(&body);
    let one = |name: &str| {
        fields
            .get(name)
            .and_then(|v| v.first())
            .cloned()
            .filter(|v| !v.is_empty())
    };
    let title = format!("{queue} {table}");
    if one("csrf").as_deref() != Some(console.form_token.as_str()) {
        return page(
            StatusCode::FORBIDDEN,
            &title,
            &console,
            "<p class=\"error\">This form is stale or not the console's (its form token does not match): reload the page and try again.</p>",
        );
    }
    let kind = match one("kind").as_deref() {
        Some("requeue") => ActionKind::Requeue,
        Some("discard") => ActionKind::Discard,
        _ => {
            return page(
                StatusCode::BAD_REQUEST,
                &title,
                &console,
                "<p class=\"error\">No action chosen.</p>",
            );
        }
    };
    let request_id = one("request_id").unwrap_or_else(new_request_id);
    let (filter, all) = if one("scope").as_deref() == Some("selected") {
        let rows: Vec<i64> = fields
            .get("row")
            .into_iter()
            .flatten()
            .filter_map(|r| r.parse().ok())
            .collect();
        (
            FilterSpec {
                rows: Some(rows),
                ..FilterSpec::default()
            },
            false,
        )
    } else {
        let spec = FilterSpec {
            consumer: one("consumer"),
            error_contains: one("error_contains"),
            older_than_s: one("older_than_s").and_then(|s| s.parse().ok()),
            rows: None,
            ids: None,
        };
        (spec, true)
    };
    let back = format!(
        "<p><a href=\"/{}/{}\">Back to the dead rows</a></p>",
        escape(&queue),
        escape(&table)
    );
    match run_action(&console, &queue, &table, kind, filter, all, &request_id).await {
        Ok(done) => {
            let verb = if kind == ActionKind::Requeue {
                "re-queued"
            } else {
                "discarded"
            };
            let again = if done.replayed {
                " This request had already been carried out: nothing more was changed."
            } else {
                ""
            };
            let mut body = format!(
                "<p class=\"done\" id=\"result\">{} of {} matching dead rows {verb}.{again}</p>",
                thousands(done.done),
                thousands(done.matched)
            );
            if done.refused > 0 {
                let _ = write!(
                    body,
                    "<p class=\"note\" id=\"refused\">{} rows left dead: they are older than their consumer's \
                     redelivery window ({}). Consumers downstream may have pruned their ids and would \
                     process a replay as a new message. Discard them instead, or start the console with a \
                     longer <code>--redelivery-window</code> if downstream keeps ids longer.</p>",
                    thousands(done.refused),
                    human(console.window),
                );
            }
            body.push_str(&back);
            page(StatusCode::OK, &title, &console, &body)
        }
        Err((status, _, detail)) => page(
            status,
            &title,
            &console,
            &format!(
                "<p class=\"error\" id=\"result\">{}</p>{back}",
                escape(&detail)
            ),
        ),
    }
}

/// `GET /unknown`.
pub(crate) async fn unknown(State(console): State<Arc<Console>>) -> Response {
    let view = read_unknown(&console).await;
    let mut body = format!(
        "<p>Rows of {} whose outcome is not settled: a mark-first effect whose call never completed, \
         or a lease that ended. Resolve each as <em>done</em> (the effect happened: recorded as processed) \
         or <em>retry</em> (it did not: deleted, the next delivery runs the handler).</p>",
        escape(&view.table)
    );
    if let Some(error) = &view.error {
        let _ = write!(body, "<p class=\"error\">{}</p>", escape(error));
    } else if view.rows.is_empty() {
        body.push_str("<p>None.</p>");
    } else {
        body.push_str(
            "<table><tr><th>consumer</th><th>message id</th><th>status</th><th></th></tr>",
        );
        for row in &view.rows {
            let actions = if console.read_only {
                String::new()
            } else {
                format!(
                    "<form method=\"post\" action=\"/unknown/resolve\" class=\"inline\">{}\
                     <input type=\"hidden\" name=\"consumer\" value=\"{}\"><input type=\"hidden\" name=\"id\" value=\"{}\">\
                     <button type=\"submit\" name=\"as\" value=\"done\">Done</button>\
                     <button type=\"submit\" name=\"as\" value=\"retry\">Retry</button></form>",
                    hidden(&console),
                    escape(&row.consumer),
                    escape(&row.message_id)
                )
            };
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{actions}</td></tr>",
                escape(&row.consumer),
                escape(&row.message_id),
                escape(&row.status)
            );
        }
        body.push_str("</table>");
    }
    page(StatusCode::OK, "Unknown outcomes", &console, &body)
}

/// `POST /unknown/resolve`.
pub(crate) async fn resolve(State(console): State<Arc<Console>>, body: Bytes) -> Response {
    let fields = form(&body);
    let one = |name: &str| {
        fields
            .get(name)
            .and_then(|v| v.first())
            .cloned()
            .unwrap_or_default()
    };
    if one("csrf") != console.form_token {
        return page(
            StatusCode::FORBIDDEN,
            "Unknown outcomes",
            &console,
            "<p class=\"error\">This form is stale or not the console's: reload the page and try again.</p>",
        );
    }
    let resolution = match one("as").as_str() {
        "done" => ResolveAs::Done,
        "retry" => ResolveAs::Retry,
        _ => {
            return page(
                StatusCode::BAD_REQUEST,
                "Unknown outcomes",
                &console,
                "<p class=\"error\">Done or retry?</p>",
            );
        }
    };
    let request_id = Some(one("request_id"))
        .filter(|id| !id.is_empty())
        .unwrap_or_else(new_request_id);
    let request = ResolveBody {
        request_id: None,
        consumer: one("consumer"),
        ids: vec![one("id")],
        resolution,
    };
    let body = match run_resolve(&console, &request, &request_id).await {
        Ok(answer) => {
            let again = if answer.replayed {
                " This request had already been carried out: nothing more was changed."
            } else {
                ""
            };
            answer
                .ids
                .iter()
                .map(|a| {
                    let what = if a.resolved {
                        "resolved"
                    } else {
                        "had nothing to resolve"
                    };
                    format!(
                        "<p class=\"done\" id=\"result\">{} {what}.{again}</p>",
                        escape(&a.id)
                    )
                })
                .collect::<String>()
        }
        Err((status, _, detail)) => {
            return page(
                status,
                "Unknown outcomes",
                &console,
                &format!("<p class=\"error\">{}</p>", escape(&detail)),
            );
        }
    };
    page(
        StatusCode::OK,
        "Unknown outcomes",
        &console,
        &format!("{body}<p><a href=\"/unknown\">Back</a></p>"),
    )
}
