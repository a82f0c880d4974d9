"""A closed invoice never changes: PostgreSQL refuses any UPDATE or DELETE of a closed invoice and any
INSERT, UPDATE or DELETE of its lines, whatever code path (ORM, queryset.update, raw SQL) tries it."""

from django.db import migrations

SQL = """
CREATE OR REPLACE FUNCTION billing_invoice_immutable() RETURNS trigger AS $$
BEGIN
    IF OLD.status = 'closed' THEN
        RAISE EXCEPTION 'invoice % is closed and cannot change', OLD.number USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION billing_invoiceline_immutable() RETURNS trigger AS $$
DECLARE
    target bigint;
BEGIN
    IF TG_OP = 'DELETE' THEN target := OLD.invoice_id; ELSE target := NEW.invoice_id; END IF;
    IF EXISTS (SELECT 1 FROM billing_invoice WHERE id = target AND status = 'closed')
       OR (TG_OP = 'UPDATE' AND EXISTS (SELECT 1 FROM billing_invoice WHERE id = OLD.invoice_id AND status = 'closed')) THEN
        RAISE EXCEPTION 'invoice % is closed: its lines cannot change', target USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;

CREATE TRIGGER billing_invoice_immutable BEFORE UPDATE OR DELETE ON billing_invoice
    FOR EACH ROW EXECUTE FUNCTION billing_invoice_immutable();
CREATE TRIGGER billing_invoiceline_immutable BEFORE INSERT OR UPDATE OR DELETE ON billing_invoiceline
    FOR EACH ROW EXECUTE FUNCTION billing_invoiceline_immutable();
"""

REVERSE = """
DROP TRIGGER IF EXISTS billing_invoice_immutable ON billing_invoice;
DROP TRIGGER IF EXISTS billing_invoiceline_immutable ON billing_invoiceline;
DROP FUNCTION IF EXISTS billing_invoice_immutable();
DROP FUNCTION IF EXISTS billing_invoiceline_immutable();
"""


class Migration(migrations.Migration):
    dependencies = [("billing", "0001_initial")]

    operations = [migrations.RunSQL(SQL, REVERSE)]
