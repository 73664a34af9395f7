//! The REST API: the subset of the Confluent Schema Registry API that clients use.
//!
//! Every answer, errors included, is JSON with `Content-Type:
//! application/vnd.schemaregistry.v1+json`; errors have Confluent's shape
//! `{"error_code": N, "message": "..."}`. Request bodies are read as JSON whatever their
//! declared content type (clients send the registry type, `application/json` or
//! `application/octet-stream`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::compat::Level;
use crate::record::{Canonical, Record};
use crate::state::Registration;
use crate::Registry;

pub const CONTENT_TYPE_V1: &str = "application/vnd.schemaregistry.v1+json";

type Shared = State<Arc<Registry>>;
type Answer = Result<Response, ApiError>;

/// The HTTP API over `registry`; serve it with [`crate::serve`] or call it directly in tests.
pub fn router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route("/", get(root))
        .route("/schemas/types", get(schema_types))
        .route("/schemas/ids/{id}", get(schema_by_id))
        .route("/schemas/ids/{id}/schema", get(raw_schema_by_id))
        .route("/schemas/ids/{id}/versions", get(versions_by_id))
        .route("/schemas/ids/{id}/subjects", get(subjects_by_id))
        .route("/subjects", get(list_subjects))
        .route("/subjects/{subject}", post(lookup).delete(delete_subject))
        .route(
            "/subjects/{subject}/versions",
            get(list_versions).post(register),
        )
        .route(
            "/subjects/{subject}/versions/{version}",
            get(get_version).delete(delete_version),
        )
        .route(
            "/subjects/{subject}/versions/{version}/schema",
            get(get_version_schema),
        )
        .route(
            "/compatibility/subjects/{subject}/versions",
            post(check_all_versions),
        )
        .route(
            "/compatibility/subjects/{subject}/versions/{version}",
            post(check_one_version),
        )
        .route(
            "/config",
            get(get_global_config)
                .put(put_global_config)
                .delete(delete_global_config),
        )
        .route(
            "/config/{subject}",
            get(get_subject_config)
                .put(put_subject_config)
                .delete(delete_subject_config),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(registry)
}

// ---------------------------------------------------------------------------------------
// Errors and replies.

/// An error answer in Confluent's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: u32,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: u32, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    fn subject_not_found(subject: &str) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            40401,
            format!("Subject '{subject}' not found."),
        )
    }

    fn version_not_found(version: &str) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            40402,
            format!("Version {version} not found."),
        )
    }

    fn schema_not_found() -> ApiError {
        Self::new(StatusCode::NOT_FOUND, 40403, "Schema not found")
    }

    fn invalid_schema(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, 42201, message)
    }

    fn invalid_version(version: &str) -> ApiError {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            42202,
            format!(
                "The specified version '{version}' is not a valid version id. Allowed values \
                 are between [1, 2^31-1] and the string \"latest\""
            ),
        )
    }

    fn invalid_level(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, 42203, message)
    }

    /// Kafka did not take a write.
    pub(crate) fn store(error: impl std::fmt::Display) -> ApiError {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            50001,
            format!("Error in the backend data store: {error}"),
        )
    }

    pub(crate) fn unauthorized() -> ApiError {
        Self::new(
            StatusCode::UNAUTHORIZED,
            40101,
            "This write needs the registry's token (Authorization: Bearer, or Basic with the token as password).",
        )
    }

    pub(crate) fn writes_closed() -> ApiError {
        Self::new(
            StatusCode::FORBIDDEN,
            40301,
            "This registry listens beyond loopback without a write token (--token), so it refuses every write.",
        )
    }

    pub(crate) fn internal(error: impl std::fmt::Display) -> ApiError {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            500,
            format!("Internal error: {error}"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        reply(
            self.status,
            &json!({"error_code": self.code, "message": self.message}),
        )
    }
}

fn reply<T: Serialize + ?Sized>(status: StatusCode, body: &T) -> Response {
    // Serialising our own reply types cannot fail; an empty object is a safe fallback.
    let body = serde_json::to_vec(body).unwrap_or_else(|_| b"{}".to_vec());
    raw(status, body)
}

fn raw(status: StatusCode, body: impl Into<axum::body::Body>) -> Response {
    let mut response = (status, body.into()).into_response();
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE_V1));
    response
}

fn ok<T: Serialize + ?Sized>(body: &T) -> Answer {
    Ok(reply(StatusCode::OK, body))
}

// ---------------------------------------------------------------------------------------
// Extractors whose failures are JSON answers too.

/// Path parameters, percent-decoded (a subject may contain `%2F`).
struct Params<T>(T);

impl<T, S> FromRequestParts<S> for Params<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(value)) => Ok(Params(value)),
            Err(rejection) => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                404,
                rejection.body_text(),
            )),
        }
    }
}

/// The boolean query flags clients send (`deleted`, `verbose`, `defaultToGlobal`,
/// `permanent`); other query parameters (`normalize`, `subject`, ...) are accepted and
/// ignored.
#[derive(Debug, Default)]
struct Flags {
    deleted: bool,
    verbose: bool,
    default_to_global: bool,
    permanent: bool,
}

impl<S: Send + Sync> FromRequestParts<S> for Flags {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let mut flags = Flags::default();
        for pair in parts.uri.query().unwrap_or_default().split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, "true"));
            let on = value.eq_ignore_ascii_case("true");
            match name {
                "deleted" => flags.deleted = on,
                "verbose" => flags.verbose = on,
                "defaultToGlobal" => flags.default_to_global = on,
                "permanent" => flags.permanent = on,
                _ => {}
            }
        }
        Ok(flags)
    }
}

/// A JSON body, whatever the content type. Malformed JSON → 400; the wrong shape → 422.
struct Body<T>(T);

impl<T, S> FromRequest<S> for Body<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                ApiError::new(
                    rejection.status(),
                    u32::from(rejection.status().as_u16()),
                    rejection.body_text(),
                )
            })?;
        serde_json::from_slice(&bytes)
            .map(Body)
            .map_err(|error| match error.classify() {
                serde_json::error::Category::Data => ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    422,
                    format!("Unprocessable entity: {error}"),
                ),
                _ => ApiError::new(
                    StatusCode::BAD_REQUEST,
                    400,
                    format!("Malformed JSON: {error}"),
                ),
            })
    }
}

// ---------------------------------------------------------------------------------------
// Request bodies and shared parsing.

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaRequest {
    schema: String,
    #[serde(default)]
    schema_type: Option<String>,
    #[serde(default)]
    references: Option<Vec<Value>>,
}

impl SchemaRequest {
    fn parse(self) -> Result<Canonical, ApiError> {
        if let Some(kind) = self.schema_type.as_deref() {
            if !kind.eq_ignore_ascii_case("AVRO") {
                return Err(ApiError::invalid_schema(format!(
                    "Schema type {kind} is not supported: this registry serves AVRO only"
                )));
            }
        }
        if self.references.is_some_and(|refs| !refs.is_empty()) {
            return Err(ApiError::invalid_schema(
                "Schema references are not supported by this registry",
            ));
        }
        Canonical::parse(&self.schema)
            .map_err(|error| ApiError::invalid_schema(format!("Invalid schema: {error}")))
    }
}

/// Confluent clients send `compatibility`; some send `compatibilityLevel` (or both).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConfigRequest {
    #[serde(default)]
    compatibility: Option<String>,
    #[serde(default)]
    compatibility_level: Option<String>,
}

impl ConfigRequest {
    fn level(&self) -> Result<Level, ApiError> {
        self.compatibility
            .as_deref()
            .or(self.compatibility_level.as_deref())
            .ok_or_else(|| ApiError::invalid_level("The body has no \"compatibility\" level"))?
            .parse()
            .map_err(ApiError::invalid_level)
    }
}

/// A version in a path: a number from 1, or `latest` (also `-1`).
enum VersionRef {
    Latest,
    Number(u32),
}

fn parse_version(text: &str) -> Result<VersionRef, ApiError> {
    if text.eq_ignore_ascii_case("latest") || text == "-1" {
        return Ok(VersionRef::Latest);
    }
    match text.parse::<u32>() {
        Ok(n) if (1..=i32::MAX as u32).contains(&n) => Ok(VersionRef::Number(n)),
        _ => Err(ApiError::invalid_version(text)),
    }
}

fn parse_id(text: &str) -> Result<u32, ApiError> {
    text.parse().map_err(|_| ApiError::schema_not_found())
}

#[derive(Debug, Serialize)]
struct SubjectVersion {
    subject: String,
    version: u32,
    id: u32,
    schema: String,
}

/// Resolves `version` of `subject` to `(version, id)`.
fn resolve(
    state: &crate::state::State,
    subject: &str,
    version: &str,
    deleted: bool,
) -> Result<(u32, u32), ApiError> {
    let wanted = parse_version(version)?;
    let versions = state
        .versions(subject, deleted)
        .ok_or_else(|| ApiError::subject_not_found(subject))?;
    let found = match wanted {
        // `latest` is the newest live version, even when deleted ones are shown.
        VersionRef::Latest => versions.iter().rev().find(|(_, entry)| !entry.deleted),
        VersionRef::Number(n) => versions.iter().find(|(v, _)| *v == n),
    };
    found
        .map(|(v, entry)| (*v, entry.id))
        .ok_or_else(|| ApiError::version_not_found(version))
}

fn subject_version(
    registry: &Registry,
    subject: &str,
    version: &str,
    deleted: bool,
) -> Result<SubjectVersion, ApiError> {
    registry.read(|state| {
        let (version, id) = resolve(state, subject, version, deleted)?;
        let schema = state
            .schema(id)
            .ok_or_else(ApiError::schema_not_found)?
            .text
            .to_string();
        Ok(SubjectVersion {
            subject: subject.to_owned(),
            version,
            id,
            schema,
        })
    })
}

// ---------------------------------------------------------------------------------------
// Handlers.

async fn root() -> Answer {
    ok(&json!({}))
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, 404, "HTTP 404 Not Found")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        405,
        "HTTP 405 Method Not Allowed",
    )
}

async fn schema_types() -> Answer {
    ok(&["AVRO"])
}

async fn schema_by_id(State(registry): Shared, Params(id): Params<String>) -> Answer {
    let id = parse_id(&id)?;
    let text = registry
        .read(|state| state.schema(id).map(|s| s.text.clone()))
        .ok_or_else(ApiError::schema_not_found)?;
    ok(&json!({ "schema": &*text }))
}

async fn raw_schema_by_id(State(registry): Shared, Params(id): Params<String>) -> Answer {
    let id = parse_id(&id)?;
    let text = registry
        .read(|state| state.schema(id).map(|s| s.text.clone()))
        .ok_or_else(ApiError::schema_not_found)?;
    Ok(raw(StatusCode::OK, text.to_string()))
}

async fn versions_by_id(
    State(registry): Shared,
    Params(id): Params<String>,
    flags: Flags,
) -> Answer {
    let id = parse_id(&id)?;
    let usages = registry
        .read(|state| state.schema(id).map(|_| state.usages(id, flags.deleted)))
        .ok_or_else(ApiError::schema_not_found)?;
    let body: Vec<Value> = usages
        .into_iter()
        .map(|(subject, version)| json!({"subject": subject, "version": version}))
        .collect();
    ok(&body)
}

async fn subjects_by_id(
    State(registry): Shared,
    Params(id): Params<String>,
    flags: Flags,
) -> Answer {
    let id = parse_id(&id)?;
    let usages = registry
        .read(|state| state.schema(id).map(|_| state.usages(id, flags.deleted)))
        .ok_or_else(ApiError::schema_not_found)?;
    let mut subjects: Vec<String> = usages.into_iter().map(|(subject, _)| subject).collect();
    subjects.dedup();
    ok(&subjects)
}

async fn list_subjects(State(registry): Shared, flags: Flags) -> Answer {
    ok(&registry.read(|state| state.subjects(flags.deleted)))
}

async fn list_versions(
    State(registry): Shared,
    Params(subject): Params<String>,
    flags: Flags,
) -> Answer {
    let versions = registry
        .read(|state| state.versions(&subject, flags.deleted))
        .ok_or_else(|| ApiError::subject_not_found(&subject))?;
    let numbers: Vec<u32> = versions.into_iter().map(|(v, _)| v).collect();
    ok(&numbers)
}

async fn get_version(
    State(registry): Shared,
    Params((subject, version)): Params<(String, String)>,
    flags: Flags,
) -> Answer {
    ok(&subject_version(
        &registry,
        &subject,
        &version,
        flags.deleted,
    )?)
}

async fn get_version_schema(
    State(registry): Shared,
    Params((subject, version)): Params<(String, String)>,
    flags: Flags,
) -> Answer {
    let found = subject_version(&registry, &subject, &version, flags.deleted)?;
    Ok(raw(StatusCode::OK, found.schema))
}

async fn register(
    State(registry): Shared,
    Params(subject): Params<String>,
    Body(request): Body<SchemaRequest>,
) -> Answer {
    let schema = request.parse()?;
    let for_plan = subject.clone();
    let id = registry
        .write(move |state| match state.plan_registration(&for_plan, schema) {
            Registration::Existing { id, version } => {
                tracing::debug!(subject = %for_plan, id, version, "The subject already has this schema.");
                Ok((Vec::new(), id))
            }
            Registration::New {
                id,
                version,
                record,
            } => {
                tracing::info!(subject = %for_plan, id, version, "Registering a schema version.");
                Ok((vec![record], id))
            }
            Registration::Incompatible { level, messages } => Err(ApiError::new(
                StatusCode::CONFLICT,
                409,
                format!(
                    "Schema being registered is incompatible with an earlier schema for \
                     subject \"{for_plan}\" (compatibility {level}), details: {messages:?}"
                ),
            )),
        })
        .await?;
    ok(&json!({ "id": id }))
}

async fn lookup(
    State(registry): Shared,
    Params(subject): Params<String>,
    flags: Flags,
    Body(request): Body<SchemaRequest>,
) -> Answer {
    let schema = request.parse()?;
    let found = registry.read(|state| {
        state
            .versions(&subject, flags.deleted)
            .ok_or_else(|| ApiError::subject_not_found(&subject))?;
        state
            .find(&subject, &schema)
            .ok_or_else(ApiError::schema_not_found)
    })?;
    let (version, id) = found;
    ok(&SubjectVersion {
        subject,
        version,
        id,
        schema: schema.text.to_string(),
    })
}

async fn delete_subject(
    State(registry): Shared,
    Params(subject): Params<String>,
    flags: Flags,
) -> Answer {
    if flags.permanent {
        return Err(permanent_unsupported());
    }
    let for_plan = subject.clone();
    let deleted = registry
        .write(move |state| {
            let versions: Vec<u32> = state
                .versions(&for_plan, false)
                .ok_or_else(|| ApiError::subject_not_found(&for_plan))?
                .into_iter()
                .map(|(v, _)| v)
                .collect();
            Ok((state.soft_delete(&for_plan, &versions), versions))
        })
        .await?;
    tracing::info!(subject, versions = ?deleted, "Soft-deleted a subject.");
    ok(&deleted)
}

async fn delete_version(
    State(registry): Shared,
    Params((subject, version)): Params<(String, String)>,
    flags: Flags,
) -> Answer {
    if flags.permanent {
        return Err(permanent_unsupported());
    }
    let for_plan = subject.clone();
    let deleted = registry
        .write(move |state| {
            let (number, _) = resolve(state, &for_plan, &version, false)?;
            Ok((state.soft_delete(&for_plan, &[number]), number))
        })
        .await?;
    tracing::info!(subject, version = deleted, "Soft-deleted a schema version.");
    ok(&deleted)
}

fn permanent_unsupported() -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        422,
        "Permanent deletes are not supported by this registry: ids must survive a replay",
    )
}

async fn check_one_version(
    State(registry): Shared,
    Params((subject, version)): Params<(String, String)>,
    flags: Flags,
    Body(request): Body<SchemaRequest>,
) -> Answer {
    let schema = request.parse()?;
    let messages = registry.read(|state| {
        let wanted = parse_version(&version)?;
        if matches!(wanted, VersionRef::Latest) && state.versions(&subject, false).is_none() {
            // Nothing registered yet: anything is compatible with nothing.
            return Ok(Vec::new());
        }
        let (number, _) = resolve(state, &subject, &version, false)?;
        Ok::<_, ApiError>(state.check(&subject, &schema, Some(number)))
    })?;
    compatibility_answer(messages, flags.verbose)
}

async fn check_all_versions(
    State(registry): Shared,
    Params(subject): Params<String>,
    flags: Flags,
    Body(request): Body<SchemaRequest>,
) -> Answer {
    let schema = request.parse()?;
    let messages = registry.read(|state| state.check(&subject, &schema, None));
    compatibility_answer(messages, flags.verbose)
}

fn compatibility_answer(messages: Vec<String>, verbose: bool) -> Answer {
    let mut body = json!({ "is_compatible": messages.is_empty() });
    if verbose {
        body["messages"] = json!(messages);
    }
    ok(&body)
}

async fn get_global_config(State(registry): Shared) -> Answer {
    let level = registry.read(|state| state.global_level());
    ok(&json!({ "compatibilityLevel": level }))
}

async fn put_global_config(State(registry): Shared, Body(request): Body<ConfigRequest>) -> Answer {
    let level = request.level()?;
    set_level(&registry, None, Some(level)).await?;
    ok(&json!({ "compatibility": level }))
}

async fn delete_global_config(State(registry): Shared) -> Answer {
    let old = registry.read(|state| state.global_level());
    set_level(&registry, None, None).await?;
    ok(&json!({ "compatibilityLevel": old }))
}

async fn get_subject_config(
    State(registry): Shared,
    Params(subject): Params<String>,
    flags: Flags,
) -> Answer {
    let level = registry.read(|state| match state.subject_level(&subject) {
        Some(level) => Ok(level),
        None if flags.default_to_global => Ok(state.global_level()),
        None => Err(no_subject_level(&subject)),
    })?;
    ok(&json!({ "compatibilityLevel": level }))
}

async fn put_subject_config(
    State(registry): Shared,
    Params(subject): Params<String>,
    Body(request): Body<ConfigRequest>,
) -> Answer {
    let level = request.level()?;
    set_level(&registry, Some(subject), Some(level)).await?;
    ok(&json!({ "compatibility": level }))
}

async fn delete_subject_config(State(registry): Shared, Params(subject): Params<String>) -> Answer {
    let old = registry
        .read(|state| state.subject_level(&subject))
        .ok_or_else(|| no_subject_level(&subject))?;
    set_level(&registry, Some(subject), None).await?;
    ok(&json!({ "compatibilityLevel": old }))
}

fn no_subject_level(subject: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        40408,
        format!("Subject '{subject}' does not have subject-level compatibility configured"),
    )
}

/// Sets (or with `None` removes) a level; writes nothing when it is already so.
async fn set_level(
    registry: &Arc<Registry>,
    subject: Option<String>,
    level: Option<Level>,
) -> Result<(), ApiError> {
    registry
        .write(move |state| {
            let current = match &subject {
                None => state.global_level_setting(),
                Some(subject) => state.subject_level(subject),
            };
            if current == level {
                return Ok((Vec::new(), ()));
            }
            tracing::info!(subject = ?subject, level = ?level, "Changing a compatibility level.");
            Ok((vec![Record::Config { subject, level }], ()))
        })
        .await
}
