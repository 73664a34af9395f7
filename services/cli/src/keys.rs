//! `sortie keys new`: a command- (or graph-) signing key (its secret file) and its keyring
//! entry.
//! `sortie keys kek`: a tenant key-encryption key for sealed run payloads.
//!
//! The secret file goes to the signer (a service's secret, the gateway's
//! `--signing-key`); the entry goes into the keyring every reducer reads (`--keyring`).
//! Rotation: make a new key for the same principal, add its entry, move the signer to
//! it, then remove the old entry (reducers re-read the keyring when it changes).

use std::path::PathBuf;

use anyhow::Context as _;
use sortie_wire::signing::{keyring_entries, keyring_text, Signer};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: KeysCommand,
}

#[derive(Debug, clap::Subcommand)]
enum KeysCommand {
    /// Make a new key: write its secret file and add its entry to a keyring file.
    New(NewArgs),
    /// Make a new key-encryption key (KEK) for a tenant's run data keys and put it first
    /// in a KEK keyring file (`--seal-keyring`): it wraps new data keys from now on, the
    /// older ones keep unwrapping theirs. The file is secret (created mode 0600).
    Kek(KekArgs),
}

#[derive(Debug, clap::Args)]
struct KekArgs {
    /// The tenant (`*`: every tenant without its own entry).
    #[arg(long)]
    tenant: String,
    /// The key's id (recorded with every data key it wraps).
    #[arg(long)]
    id: String,
    /// The KEK keyring file (created if missing).
    #[arg(long)]
    keyring: PathBuf,
}

#[derive(Debug, clap::Args)]
struct NewArgs {
    /// The key's id (the `sortie-key` header of what it signs).
    #[arg(long)]
    id: String,
    /// The principal it signs as (a delegate key: the signer's own name).
    #[arg(long)]
    principal: String,
    /// A tenant it may sign for (repeatable; `*` for any).
    #[arg(long = "tenant", required = true)]
    tenants: Vec<String>,
    /// A role its commands may claim (repeatable).
    #[arg(long = "role")]
    roles: Vec<String>,
    /// An approver group its commands may claim (repeatable).
    #[arg(long = "group")]
    groups: Vec<String>,
    /// Signs for principals it authenticated itself (the gateway's key).
    #[arg(long)]
    delegate: bool,
    /// May sign graph publications (`sortie graph publish --signing-key`) as its
    /// principal, for its tenants (`*`: graphs of every tenant).
    #[arg(long)]
    publisher: bool,
    /// Where to write the secret key file (refused if it exists).
    #[arg(long)]
    secret: PathBuf,
    /// The keyring file to add the entry to (created if missing).
    #[arg(long)]
    keyring: PathBuf,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        KeysCommand::New(args) => new(args),
        KeysCommand::Kek(args) => kek(args),
    }
}

/// Each of `values` is a legal id for `flag` (not empty, no control or invisible
/// character, no surrounding whitespace): a key nobody can name is refused before it is made.
fn check_ids<'a>(flag: &str, values: impl IntoIterator<Item = &'a String>) -> anyhow::Result<()> {
    for value in values {
        sortie_core::limits::check_id(flag, value).map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// `path`'s directory exists, so the file can be written there (checked before any file
/// is written: a secret written next to a keyring that cannot be would block the retry).
fn check_dir(flag: &str, path: &std::path::Path) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    anyhow::ensure!(
        dir.is_dir(),
        "{flag} {}: the directory {} does not exist",
        path.display(),
        dir.display()
    );
    Ok(())
}

fn kek(args: KekArgs) -> anyhow::Result<()> {
    check_ids("--tenant", [&args.tenant])?;
    check_ids("--id", [&args.id])?;
    check_dir("--keyring", &args.keyring)?;
    let existing = match args.keyring.exists() {
        true => Some(
            std::fs::read_to_string(&args.keyring)
                .with_context(|| format!("reading {}", args.keyring.display()))?,
        ),
        false => None,
    };
    let text = sortie_seal::kek::Keyring::add(existing.as_deref(), &args.tenant, &args.id)
        .with_context(|| format!("--keyring {}", args.keyring.display()))?;
    match existing {
        Some(_) => std::fs::write(&args.keyring, text)
            .with_context(|| format!("writing {}", args.keyring.display()))?,
        None => write_secret(&args.keyring, &text)?,
    }
    println!(
        "key-encryption key {} for tenant {} put first in {}",
        args.id,
        args.tenant,
        args.keyring.display()
    );
    Ok(())
}

fn new(args: NewArgs) -> anyhow::Result<()> {
    check_ids("--id", [&args.id])?;
    check_ids("--principal", [&args.principal])?;
    check_ids("--tenant", &args.tenants)?;
    check_ids("--role", &args.roles)?;
    check_ids("--group", &args.groups)?;
    check_dir("--secret", &args.secret)?;
    check_dir("--keyring", &args.keyring)?;
    anyhow::ensure!(
        !args.secret.exists(),
        "{} exists; not overwriting a key",
        args.secret.display()
    );
    let mut entries = if args.keyring.exists() {
        let text = std::fs::read_to_string(&args.keyring)
            .with_context(|| format!("reading {}", args.keyring.display()))?;
        // A keyring that does not load is not made worse.
        keyring_entries(&text).with_context(|| format!("--keyring {}", args.keyring.display()))?
    } else {
        Vec::new()
    };
    anyhow::ensure!(
        !entries.iter().any(|e| e.id == args.id),
        "{} already has a key {:?}",
        args.keyring.display(),
        args.id
    );
    let signer = Signer::generate(&args.id)?;
    let mut entry = signer.entry(&args.principal, &args.tenants, &args.roles, args.delegate);
    entry.groups = args.groups;
    entry.publisher = args.publisher;
    entries.push(entry);
    write_secret(&args.secret, &signer.to_file())?;
    if let Err(error) = std::fs::write(&args.keyring, keyring_text(&entries)) {
        // A secret without its entry would only block the next attempt ("exists").
        let _ = std::fs::remove_file(&args.secret);
        return Err(error).with_context(|| format!("writing {}", args.keyring.display()));
    }
    println!(
        "key {} for {}: secret in {}, entry added to {}",
        args.id,
        args.principal,
        args.secret.display(),
        args.keyring.display()
    );
    Ok(())
}

/// Writes a secret readable by its owner only.
pub(crate) fn write_secret(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(text.as_bytes())?;
    Ok(())
}
