from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from catalog.models import ServedModel


class Command(BaseCommand):
    help = "Register (or update) a served model: the id clients use, where it loads from, and its pool."

    def add_arguments(self, parser):
        parser.add_argument("model_id")
        parser.add_argument("--path", required=True, help="Directory or hub id the engine loads")
        parser.add_argument("--pool", required=True, help="Worker pool name (Celery queue pool.<pool>)")
        parser.add_argument("--context-length", type=int, required=True)
        parser.add_argument("--cold-start-wait", type=int, default=0, help="Seconds a request waits for a worker")
        parser.add_argument("--disable", action="store_true")
        parser.add_argument("--images", action="store_true", help="The model takes images in chat messages")

    def handle(self, *args, model_id, path, pool, context_length, cold_start_wait, disable, images, **options):
        model = ServedModel.objects.filter(model_id=model_id).first() or ServedModel(model_id=model_id)
        created = model.pk is None
        model.path, model.pool, model.context_length = path, pool, context_length
        model.cold_start_wait_seconds, model.is_enabled = cold_start_wait, not disable
        model.accepts_images = images
        try:
            model.full_clean()
        except ValidationError as exc:
            raise CommandError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())) from exc
        model.save()
        self.stdout.write(f"{'registered' if created else 'updated'} model {model.model_id} on queue {model.queue}")
