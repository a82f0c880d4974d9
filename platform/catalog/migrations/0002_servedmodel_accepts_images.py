from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="servedmodel",
            name="accepts_images",
            field=models.BooleanField(default=False),
        ),
    ]
