"""The layer lifecycle below the operations: capturing reverse diffs,
applying them (undo, a rollback's loop and its batches), what a redo keeps,
reading the past, the stack's views, the pending record, capture filters
and tree snapshots."""
