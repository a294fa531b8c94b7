//! MySQL and MariaDB: no wake-ups; workers and relays poll.

use sqlx::{MySql, Pool};

use super::WakeBackend;
use crate::table::Table;

impl WakeBackend for MySql {
    /// No notifications: workers poll.
    type Wakeup = ();

    async fn wake_listen<'a>(_: &'a Pool<Self>, _: &'a Table) -> Option<()> {
        None
    }

    async fn wake_wait(_: &mut ()) -> bool {
        false
    }

    async fn wake_notify<'a>(_: &'a Pool<Self>, _: &'a Table) -> Result<(), sqlx::Error> {
        Ok(())
    }
}
